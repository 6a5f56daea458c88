# Allocate just over the memory limit.
# expect: MemoryError
block = bytearray(LIMITS["memory_mb"] * 2**20)
