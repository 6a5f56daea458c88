# Raise the rlimits back, then allocate past the configured memory limit.
# expect: not allowed to raise|MemoryError
import resource

resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
block = bytearray(LIMITS["memory_mb"] * 2**20)
