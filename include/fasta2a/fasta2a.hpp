// fasta2a: the whole library. Include this, or only the headers you use. It holds every header of
// include/fasta2a/, none of which needs more than Eigen; the transports and bootstraps
// (fasta2a/host.hpp, fasta2a/mpi.hpp, fasta2a/tcp_bootstrap.hpp, ...) come with their own targets
// and dependencies (fasta2a::host, fasta2a::mpi, fasta2a::tcp, ...).
#pragma once

#include "fasta2a/common.hpp"
#include "fasta2a/cost_model.hpp"
#include "fasta2a/coupled_progress.hpp"
#include "fasta2a/decompose.hpp"
#include "fasta2a/engine.hpp"
#include "fasta2a/factorized.hpp"
#include "fasta2a/fewer_stages.hpp"
#include "fasta2a/json.hpp"
#include "fasta2a/json_writer.hpp"
#include "fasta2a/plan_reader.hpp"
#include "fasta2a/memory.hpp"
#include "fasta2a/pattern.hpp"
#include "fasta2a/plan.hpp"
#include "fasta2a/planner.hpp"
#include "fasta2a/program.hpp"
#include "fasta2a/registry.hpp"
#include "fasta2a/rma.hpp"
#include "fasta2a/svg.hpp"
#include "fasta2a/topology.hpp"
#include "fasta2a/traffic.hpp"
#include "fasta2a/transport.hpp"
#include "fasta2a/transpose.hpp"
#include "fasta2a/verify.hpp"
