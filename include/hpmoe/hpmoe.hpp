#pragma once
// hpmoe's public face, in one include:
//
//   #include <hpmoe/hpmoe.hpp>
//
//   hpmoe::LayerConfig spec = hpmoe::preset("mixtral-8x7b");   // or load_config_file, or fields by hand
//   hpmoe::Layer layer(spec, hpmoe::random_weights(spec, 1), {.workers_per_rank = 2});
//   auto step = layer.forward(x);        // x: hpmoe::Matrix [tokens, hidden], or a MatrixView of yours
//   step.backward(dy);                   // step.gradients(): dx and every weight's gradient
//
// What is here: the layer (hpmoe::Layer, its spec LayerConfig, weights and
// parallel setting), expert placement and its planning (replicas from a
// load history, revisions, the online policy), transports (in process,
// MPI), the layer's math as an fp64 oracle, and safetensors checkpoints. The compiler,
// the op table and the engine behind Layer are internal.
#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/layer.hpp"
#include "hpmoe/placement.hpp"
#include "hpmoe/planning.hpp"
#include "hpmoe/reference.hpp"
#include "hpmoe/routing.hpp"
#include "hpmoe/safetensors.hpp"
#include "hpmoe/tensors.hpp"
#include "hpmoe/transport.hpp"
