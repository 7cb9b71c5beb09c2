"""Replay: golden scenarios, op sequences with their recordings, replayed against any target.

``scenario`` (the file format, replay and recording) and ``golden/`` (the
scenarios shipped with tqbatch, one per pinned bug).
"""
