"""`python -m spmdrl ...` is the `spmdrl` command."""
from spmdrl.cli import main

if __name__ == "__main__":
    main()
