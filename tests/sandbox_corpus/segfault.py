# Crash the interpreter (a segfault through ctypes).
# expect: killed
import ctypes

ctypes.string_at(0)
