"""`python -m infsamp ...`: what launchers run (`torchrun --nproc-per-node N -m infsamp train CFG`,
`accelerate launch -m infsamp train CFG`)."""

import sys

from infsamp.cli import main

if __name__ == "__main__":
    sys.exit(main())
