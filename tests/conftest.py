import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "operator"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
