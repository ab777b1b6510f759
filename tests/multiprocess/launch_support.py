"""The shape of the fault-free reference run (``conftest.reference``) that multi-process tests compare with.

A module of its own, because ``from conftest import ...`` finds whichever conftest was imported last.
"""

# The runs compared with it must use the same: 3 worker processes x 2 CPU devices, 30 steps of the demo model.
STEPS = 30
NPROCS = 3
