#pragma once
// Loopback TCP ports for rendezvous tests.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "support/doctest.hpp"

namespace paratrain_test {

/// A loopback socket bound to a port the kernel chose, and that port; not listened on.
struct BoundPort {
  int fd = -1;
  int port = 0;
};

inline BoundPort bind_loopback_port() {
  BoundPort b;
  b.fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(b.fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(b.fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  socklen_t length = sizeof address;
  REQUIRE(::getsockname(b.fd, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  b.port = ntohs(address.sin_port);
  return b;
}

/// A port free on this host now: bound by the kernel's choice, then released.
inline int free_port() {
  const auto b = bind_loopback_port();
  ::close(b.fd);
  return b.port;
}

}  // namespace paratrain_test
