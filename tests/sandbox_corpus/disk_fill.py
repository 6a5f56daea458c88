# Fill the disk: 1 MiB writes into many files until something stops us.
# expect: No space left|File too large
i = 0
while True:
    with open(f"fill_{i}.bin", "wb") as f:
        for _ in range(16):
            f.write(b"x" * 2**20)
    i += 1
