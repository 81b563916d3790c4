#include "op_table.h"
namespace flame::test {
void add_loss_cases(CaseList&) {}
}  // namespace flame::test
