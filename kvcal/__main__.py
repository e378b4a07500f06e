"""``python -m kvcal`` (also ``torchrun --nproc-per-node N -m kvcal calibrate ...``)."""

from kvcal.cli import main

if __name__ == "__main__":
    main()
