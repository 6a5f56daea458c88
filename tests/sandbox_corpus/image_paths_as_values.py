# Return strings that look like image paths (absolute, .., the victim) as the cell's result and via display.
# expect: FORGED_PATHS
paths = [VICTIM, "../" * 8 + VICTIM.lstrip("/"), "/etc/shadow"]
display(*paths)
print("FORGED_PATHS")
paths
