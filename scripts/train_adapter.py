#!/usr/bin/env python
"""Train a LoRA adapter with a visible behaviour on the CPU (``loraplex/lora/train.py``).

Usage: ``python scripts/train_adapter.py --behaviour caps --output DIR [--steps N] [--seed S]``
Same as ``python -m loraplex.lora.train ...``; works from a checkout without installing.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's loraplex

from loraplex.lora.train import main

if __name__ == "__main__":
    sys.exit(main())
