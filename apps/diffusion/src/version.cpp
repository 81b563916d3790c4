// Placeholder so the library has a source until the trainer lands.
namespace flame_diffusion {
int version() { return 0; }
}  // namespace flame_diffusion
