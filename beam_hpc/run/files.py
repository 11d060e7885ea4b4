"""TEMPORARY shim (issue 41): the atomic-file helpers moved to the leaf :mod:`beam_hpc.files`.

This name stays only while files that other engineers were editing during the move still import
``beam_hpc.run.files``; once their import lines say ``beam_hpc.files``, this module goes. It is the
same module object, so a monkeypatch through either name reaches the one implementation.
"""

import sys

from beam_hpc import files

sys.modules[__name__] = files
