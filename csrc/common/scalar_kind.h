// The element types the kernels take, named without torch headers (for .cu launch interfaces).
#pragma once

namespace remat {

enum class ScalarKind { kFloat32, kFloat16, kBFloat16 };

}  // namespace remat
