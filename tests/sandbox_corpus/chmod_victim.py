# Delete, truncate or chmod the victim through every path form.
# expect: No such file|Permission denied|Read-only
import os

for path in (VICTIM, "../" * 10 + VICTIM.lstrip("/")):
    for action in (os.remove, lambda p: os.chmod(p, 0o777), lambda p: open(p, "w").close()):
        try:
            action(path)
        except OSError as exc:
            last = exc
raise last
