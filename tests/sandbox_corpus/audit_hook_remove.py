# Neutralise Python-level hooks (audit hooks, import blockers) via ctypes, then read the secret.
# expect: No such file|Permission denied
import ctypes
import sys

sys.meta_path[:] = [f for f in sys.meta_path if "BlockImports" not in type(f).__name__]
try:
    ctypes.pythonapi.PySys_ResetWarnOptions()
except AttributeError:
    pass
print(open(SECRET_FILE).read())
