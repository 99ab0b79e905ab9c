#!/usr/bin/env python
"""Train a LoRA adapter with a visible behaviour on the CPU (``loraplex/tools/train_adapter.py``).

Usage: ``python scripts/train_adapter.py --behaviour caps --output DIR [--steps N] [--seed S]``
Same as ``python -m loraplex.tools.train_adapter ...``; works from a checkout without installing.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's loraplex

from loraplex.tools.train_adapter import main

if __name__ == "__main__":
    sys.exit(main())
