"""The test suite's subprocesses end without the interpreter's last
garbage collection: with torch imported it walks millions of objects and
takes about a second of CPU per process, and the suite starts hundreds of
processes (ranks, supervisors, replacements, torchrun). ``conftest.py``
puts this directory first on the ``PYTHONPATH`` the subprocesses inherit;
``test_exit.py``, which checks how a program ends, runs without it.

At exit the objects alive are moved to the permanent generation
(``gc.freeze``), which the final collection skips; atexit handlers, and
everything else an interpreter does when it ends, run as usual.
"""

import atexit
import gc

atexit.register(gc.freeze)
