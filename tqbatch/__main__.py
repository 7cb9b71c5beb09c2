"""``python -m tqbatch``: the same command line as the ``tqbatch`` console script."""

from tqbatch.cli import console_main

if __name__ == "__main__":
    console_main()
