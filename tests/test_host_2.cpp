// The host program's second translation unit (test_host.cpp says why the files are grouped).
#include <doctest/doctest.h>

#include "test_conformance_host.cpp"
#include "test_tcp_bootstrap.cpp"
#include "test_tcp_bootstrap_security.cpp"
