import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tests run against the source tree even when the package is not installed.
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)
