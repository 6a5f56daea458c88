# Raw and packet sockets, netlink (routing), to sniff or forge traffic.
# expect: Address family not supported|Operation not permitted
import socket

socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)
