# Swap modules in sys.modules (os, posixpath, builtins.open) for permissive fakes, then read and write outside.
# expect: No such file|Permission denied
import builtins
import io
import sys
import types

fake = types.ModuleType("posixpath")
fake.realpath = lambda p: "/tmp"
sys.modules["posixpath"] = fake
builtins.open = io.open
print(io.open(SECRET_FILE).read())
io.open(MARKER, "w").write("escaped")
