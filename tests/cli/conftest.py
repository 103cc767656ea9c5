import os
import sys

# tests/fakes.py is shared by the runner, api and cli tests.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
