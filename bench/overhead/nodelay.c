/* LD_PRELOAD shim: TCP_NODELAY on every accepted socket.
 *
 * sglang-router 0.3.2 leaves Nagle's algorithm on for the connections it accepts, so
 * a small write that follows another one waits for the client's delayed ACK (~40 ms
 * on Linux). The overhead bench runs it twice, as shipped and with this shim, to show
 * both. Built by setup_peers.sh:  cc -O2 -shared -fPIC -o nodelay.so nodelay.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

typedef int (*accept_fn)(int, struct sockaddr *, socklen_t *);
typedef int (*accept4_fn)(int, struct sockaddr *, socklen_t *, int);

static void nodelay(int fd) {
    int one = 1;
    if (fd >= 0)  /* fails harmlessly on non-TCP sockets */
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int accept(int fd, struct sockaddr *addr, socklen_t *len) {
    static accept_fn real;
    if (!real) real = (accept_fn)dlsym(RTLD_NEXT, "accept");
    int conn = real(fd, addr, len);
    nodelay(conn);
    return conn;
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    static accept4_fn real;
    if (!real) real = (accept4_fn)dlsym(RTLD_NEXT, "accept4");
    int conn = real(fd, addr, len, flags);
    nodelay(conn);
    return conn;
}
