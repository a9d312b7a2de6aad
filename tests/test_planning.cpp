// The planning tests: traffic, topologies, the planner and its decomposers, the verifier, the cost
// model, rank programs, plan files, per-rail plans, the registry and the RMA transports' shared
// code. Each file below holds one part's tests and could be a program of its own; they are built
// as one translation unit because they instantiate the same heavy templates (the planner and the
// decomposers over Eigen): one unit compiles in less than half the CPU time of eleven (CI's build
// runs on 2 cores). Their helpers are in anonymous namespaces, which one unit shares, so the
// helpers several files use live in workloads.hpp and checks.hpp.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "test_traffic.cpp"
#include "test_topology.cpp"
#include "test_planner.cpp"
#include "test_fewer_stages.cpp"
#include "test_verify.cpp"
#include "test_cost_model.cpp"
#include "test_program.cpp"
#include "test_json.cpp"
#include "test_per_rail.cpp"
#include "test_registry.cpp"
#include "test_rma.cpp"
