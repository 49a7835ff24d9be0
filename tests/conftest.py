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

# Without a GPU, Triton runs only under its interpreter, and Triton decides interpreter or
# compiler for its own library functions when it is first imported (transformers may import
# it early). So the whole CPU session runs with TRITON_INTERPRET=1, while PAGODA_DISABLE_TRITON
# keeps the engine on the fast torch references; tests/kernels lifts it per module.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("PAGODA_DISABLE_TRITON", "1")
