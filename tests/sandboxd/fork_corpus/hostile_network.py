import socket
try:
    print("dns", socket.getaddrinfo("example.com", 80))
except OSError as e:
    print("dns failed", type(e).__name__)
for host in ("127.0.0.1", "10.0.0.1"):
    try:
        socket.create_connection((host, 1), timeout=1)
        print("connected", host)
    except OSError as e:
        print("connect failed", host, type(e).__name__)
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen()
c = socket.create_connection(srv.getsockname())
print("own loopback works", srv.accept()[1][0])
