// The engine on the host transport (ranks as threads): the engine's tests, the conformance suite
// (tests/conformance/) on host worlds, and the TCP bootstrap (ranks as threads and as forked
// processes). Built as one translation unit, like test_planning.cpp: the three instantiate the same
// engine, which one unit compiles in about half the CPU time of three.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "test_engine_host.cpp"
#include "test_conformance_host.cpp"
#include "test_tcp_bootstrap.cpp"
