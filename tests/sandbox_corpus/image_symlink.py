# Return images that are symlinks / paths to files outside the scratch dir.
# expect: No such file|Permission denied
import os

os.symlink(SECRET_FILE, "secret.png")
os.symlink("../../../../" + VICTIM, "victim.png")
display(Image.open("secret.png"))
display(Image.open("victim.png"))
