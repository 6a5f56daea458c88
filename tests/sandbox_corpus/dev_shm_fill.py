# Fill memory through writable places outside the scratch dir's size limit: /dev/shm, /dev, /dev/pts, /, /proc.
# expect: Read-only file system|Permission denied
errors = []
for folder in ("/dev/shm", "/dev", "/dev/pts", "/", "/proc/self"):
    try:
        with open(f"{folder}/fill.bin", "wb") as f:
            for _ in range(64):
                f.write(b"x" * 2**20)
    except OSError as exc:
        errors.append(exc)
        continue
    open(MARKER, "w").write(folder)  # the host check sees it only if the marker's folder were reachable too
    raise SystemExit(f"wrote 64 MiB into {folder}")
print([e.strerror for e in errors])
raise errors[0]  # /dev/shm's
