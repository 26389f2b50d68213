// The placement export file (docs/formats.md#placement-export): EPLB's tensors as
// JSON, written by `moectl placement export` and read back by `placement import`,
// and the shape text EXPERTSxLAYERS@NODESxDEVICES the CLI takes.
#pragma once

#include <string>

#include "moe/v1/placement.pb.h"

namespace moe::spec {

// "64x2@2x2"; an empty text is the empty shape (the agent's current one). Throws
// moe::InvalidArgument naming the expected form.
v1::PlacementShape parse_shape(const std::string& text);
std::string shape_text(const v1::PlacementShape& s);

// phy2log [layers, slots], log2phy [layers, E, max replicas] (-1 padded), logcnt
// [layers, E], the shape and each layer's epoch; in this order, so exports diff.
std::string placement_export_json(const v1::PlacementReply& p);

// The import request of an export file's text: the shape and each layer's map,
// whose logcnt must agree with phy2log (log2phy and epoch are not read). Throws
// moe::InvalidArgument naming `file` and the field.
v1::PlacementImport placement_import_from_json(const std::string& text, const std::string& file);

}  // namespace moe::spec
