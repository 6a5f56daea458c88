# A socket of every family and type; connect to the host's TCP port and unix socket.
# expect: HOST_NOT_REACHED
import socket

opened = []
for family in range(46):
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW):
        try:
            opened.append(socket.socket(family, kind))
        except OSError:
            pass
for target in ((socket.AF_INET, ("127.0.0.1", HOST_PORT)), (socket.AF_UNIX, HOST_SOCK)):
    try:
        s = socket.socket(target[0], socket.SOCK_STREAM)
        s.settimeout(1)
        s.connect(target[1])
        s.sendall(b"escaped")
    except OSError as exc:
        print("blocked", exc)
print("HOST_NOT_REACHED", [s.family for s in opened])
