// fasta2a: the whole library. Include this, or only the headers you use.
#pragma once

#include "fasta2a/common.hpp"
#include "fasta2a/cost_model.hpp"
#include "fasta2a/decompose.hpp"
#include "fasta2a/plan.hpp"
#include "fasta2a/planner.hpp"
#include "fasta2a/topology.hpp"
#include "fasta2a/traffic.hpp"
#include "fasta2a/verify.hpp"
#include "fasta2a/json.hpp"
#include "fasta2a/registry.hpp"
#include "fasta2a/svg.hpp"
