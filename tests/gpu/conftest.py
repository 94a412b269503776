"""tests/gpu/: the one-GPU tier's own tests (launch/gpu_tier.sh). Their helpers are tests/'s (launching.py,
devices.py); pytest puts only this directory on sys.path, so tests/ is added here."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
