"""Replay: golden scenarios, op sequences with their recordings, replayed against any target.

``scenario`` (the file format: reading, writing, discovering), ``replayer``
(replaying one against a target), ``recorder`` (recording one) and
``golden/`` (the scenarios shipped with tqbatch, one per pinned bug).
"""
