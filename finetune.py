"""Fine-tune orb-v2 on one device: python finetune.py --config configs/config.yaml [--key value ...]"""

import sys

from orb.training.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], parallel=False))
