"""``python -m autockpt``: the same command line as the ``autockpt`` console script."""

from autockpt.present.cli import main

if __name__ == "__main__":
    main(prog_name="autockpt")
