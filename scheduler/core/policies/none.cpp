// `none`: every channel direct; the GPU's own arbitration decides.  The
// baseline every other policy is measured against.
#include "policies.hpp"

namespace pvgpu {

namespace {

class NonePolicy final : public Policy {
public:
    std::string_view name() const override { return "none"; }
    void start(PolicyContext& ctx) override { ctx_ = &ctx; }
    void stop() override {}
    void channel_added(ChannelId ch, EntityId) override { ctx_->set_mode(ch, ChannelMode::Direct); }
    void channel_removed(ChannelId, EntityId) override {}
    void tree_changed(EntityTree::Change, EntityId) override {}
    void doorbell_trapped(ChannelId, std::uint32_t) override {}
    void fence(ChannelId, std::uint32_t) override {}
    void channel_error(ChannelId, std::uint32_t) override {}

private:
    PolicyContext* ctx_ = nullptr;
};

}  // namespace

PolicyInfo none_info() {
    return {"none", "the GPU's own arbitration, no scheduling (baseline)", {}};
}

std::unique_ptr<Policy> make_none(const PolicyParams&) { return std::make_unique<NonePolicy>(); }

}  // namespace pvgpu
