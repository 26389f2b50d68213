// The fp64 reference (kernels/ref) set up like a layer: its config from a
// MoeLayerConfig, its weights from the layer's host weights. Used by verify and by
// the tests, so the two describe a layer the same way.
#pragma once

#include "moe/layer_spec/layer_config.h"
#include "moe/ref/moe_ref.h"

namespace moe::ep {

ref::Config reference_config(const MoeLayerConfig& cfg);
ref::Weights reference_weights(const model::LayerWeights& w);

}  // namespace moe::ep
