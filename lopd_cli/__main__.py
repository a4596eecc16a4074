"""`python -m lopd_cli …` is the same as `lopd …` (so torchrun and accelerate can launch it)."""

from lopd_cli.cli.main import run

if __name__ == "__main__":
    run()
