"""One lock between the checkpoint writer's background thread and the fork of loader workers.

A forked child has only the thread that forked: a lock another thread held at that moment (inside
torch.save, pickle, zlib) stays held in the child for good, and a loader worker that needs it hangs;
its rank then waits for batches until the group's collective timeout. Seen in CI: the epoch's loader
forked its workers at the start of epoch 4, while the writer serialised the epoch-3 checkpoint, and
both ranks stood still for the whole 600 s distributed timeout. The writer holds `GATE` while it
serialises a file; the loader forks its workers under it, so a fork waits for at most the file being
written (the write runs on once the workers exist). Importing this module imports nothing heavy.
"""

from __future__ import annotations

import threading

GATE = threading.Lock()
