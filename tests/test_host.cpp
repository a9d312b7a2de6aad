// The engine on the host transport (ranks as threads): the engine's tests here, and in
// test_host_2.cpp the conformance suite (tests/conformance/) on host worlds and the TCP bootstrap
// (ranks as threads and as forked processes). One program of two translation units, like
// test_planning: the three files instantiate the same engine, the engine's tests about as much of
// it as the other two together, so two units compile side by side on CI's 2 cores in less CPU time
// than three.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "test_engine_host.cpp"
