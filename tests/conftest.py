import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "operator"))
# The repository root goes first: tests/kernels must never shadow the kernels package.
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One converted copy of the embedded model for the whole suite (and across local runs).
os.environ.setdefault("PAGODA_CACHE_DIR", str(ROOT / ".cache" / "pagoda"))
