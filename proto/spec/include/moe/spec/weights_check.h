// A job's weights file checked where the agent reads it, at submit
// (docs/jobs.md#weights): that it exists and is a safetensors file, an index or a
// folder of either, and that it holds the router of every layer the job asks
// for, [experts, hidden]. Headers and the index only: no tensor data. The ranks
// check every tensor again as they load (docs/formats.md#hugging-face-schemes).
#pragma once

#include "moe/v1/job.pb.h"

namespace moe::spec {

// Throws moe::InvalidArgument "weights: ..." naming the file and what is missing
// (with the layers the file has, when it has others). No-op without weights.
void check_weights(const v1::JobSpec& spec);

// The tensor prefix of job layer `layer`: every "{layer}" in weights_prefix
// becomes the checkpoint layer weights_first_layer + layer.
std::string checkpoint_prefix(const v1::JobSpec& spec, int layer);

}  // namespace moe::spec
