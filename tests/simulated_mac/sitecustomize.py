"""Start every Python process on a simulated Mac when ``$TQBATCH_SIMULATED_METAL`` says so.

Put this directory on ``PYTHONPATH`` (``PYTHONPATH=tests/simulated_mac
TQBATCH_SIMULATED_METAL=zeros tqbatch backend --device gpu``): Python imports
``sitecustomize`` at start-up, in subprocesses too, so the pretence is in place
before anything imports mlx. See ``tqbatch.testing.backend.simulated_metal``.
"""

from tqbatch.testing.backend.simulated_metal import install_from_environment

install_from_environment()
