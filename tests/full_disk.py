"""A child process whose writes fail as they do on a full disk, without filling one.

The child lowers its file-size limit (``RLIMIT_FSIZE``) and ignores ``SIGXFSZ``: a write past the limit then
fails with ``EFBIG`` the way one on a full disk fails with ``ENOSPC``, from the kernel, on a real file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PRELUDE = """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
"""


def run_with_full_disk(code: str, *args: str, limit: int = 4096, setup: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``setup`` (imports: free to write) and then ``code`` in a child whose files cannot grow past
    ``limit`` bytes; ``args`` are its ``sys.argv[1:]``. Returns the finished process (stdout, stderr)."""
    script = textwrap.dedent(setup) + PRELUDE.format(limit=limit) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, check=False)
