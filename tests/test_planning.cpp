// The planning tests: traffic, topologies, the planner and its decomposers, the verifier, the cost
// model, rank programs, plan files, per-rail plans, the registry and the RMA transports' shared
// code. Each file included here and in test_planning_2.cpp holds one part's tests and could be a
// program of its own; they are built as one program of two translation units because they
// instantiate the same heavy templates (the planner and the decomposers over Eigen): two units
// compile in about half the CPU time of eleven, and build side by side on CI's 2 cores. Their
// helpers are in anonymous namespaces, which one unit shares, so the helpers several files use
// live in workloads.hpp and checks.hpp.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "test_planner.cpp"
#include "test_transpose.cpp"
#include "test_fewer_stages.cpp"
#include "test_verify.cpp"
#include "test_per_rail.cpp"
#include "test_topology.cpp"
#include "test_rma.cpp"
