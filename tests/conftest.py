"""pytest's own hooks only. The helpers the tests share live in tests/support.py (run, check, the launchers)."""
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # `import support` works from any working directory
