# Return one enormous image (a decompression bomb if it came back at full size).
# expect: SHOWN
display(Image.new("L", (20000, 20000)))
print("SHOWN")
