// The pvgpu parts of libvirt domain XML: metadata parsing and the device
// wiring edits of pvgpuctl attach/detach (scheduler/libvirt/domain_xml.*).
#include <catch2/catch.hpp>

#include "domain_xml.hpp"
#include "proto/share_text.hpp"

using namespace pvgpu::virt;

namespace {

const char* kDomain = R"(<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>web1</name>
  <uuid>5f0c1a2e-8d1b-4c55-9a10-6e0d2fbeb602</uuid>
  <memory unit='MiB'>256</memory>
  <devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices>
  <qemu:commandline>
    <qemu:arg value='-L'/><qemu:arg value='/usr/share/seabios'/>
  </qemu:commandline>
</domain>)";

int count(const std::string& s, const std::string& what) {
    int n = 0;
    for (auto p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
    return n;
}

}  // namespace

TEST_CASE("gpu metadata: the weight, in and out of our namespace", "[libvirt]") {
    CHECK(parse_gpu_metadata(R"(<gpu weight="200"/>)").weight == 200);
    CHECK(parse_gpu_metadata(R"(<pvgpu:gpu xmlns:pvgpu="http://pvgpu.org/xmlns/domain/1.0" weight="1"/>)").weight ==
          1);
    CHECK(parse_gpu_metadata(R"(<gpu weight="10000"/>)").weight == 10000);
    CHECK(parse_gpu_metadata("<gpu/>").weight == 100);
    CHECK(parse_gpu_metadata(format_gpu_metadata({345})).weight == 345);
}

TEST_CASE("gpu metadata: anything else is a clear error", "[libvirt]") {
    for (const char* bad : {R"(<gpu weight="0"/>)", R"(<gpu weight="10001"/>)", R"(<gpu weight="-5"/>)",
                            R"(<gpu weight="2e2"/>)", R"(<gpu weight=""/>)", R"(<gpu weight=" 200"/>)",
                            R"(<gpu weight="99999999999999999999"/>)", R"(<gpu wieght="200"/>)",
                            R"(<cpu weight="200"/>)", R"(<gpu weight="200"><task/></gpu>)",
                            R"(<x:gpu xmlns:x="http://example.org/other" weight="200"/>)", "<gpu", "", "weight=200"}) {
        INFO(bad);
        CHECK_THROWS_AS(parse_gpu_metadata(bad), XmlError);
    }
    try {
        parse_gpu_metadata(R"(<gpu weight="lots"/>)");
        FAIL("accepted");
    } catch (const XmlError& e) {
        CHECK(std::string(e.what()).find("'lots'") != std::string::npos);
        CHECK(std::string(e.what()).find('\n') == std::string::npos);
    }
}

TEST_CASE("gpu metadata: the device attribute names the GPU", "[libvirt]") {
    const GpuMetadata m = parse_gpu_metadata(R"(<gpu weight="200" device="1"/>)");
    CHECK(m.weight == 200);
    CHECK(m.device == 1u);
    CHECK_FALSE(parse_gpu_metadata(R"(<gpu weight="200"/>)").device);  // pvgpud places it
    const GpuMetadata only = parse_gpu_metadata(
        R"(<pvgpu:gpu xmlns:pvgpu="http://pvgpu.org/xmlns/domain/1.0" device="15"/>)");
    CHECK(only.weight == 100);
    CHECK(only.device == 15u);
    CHECK(parse_gpu_metadata(R"(<gpu device="0"/>)").device == 0u);
    CHECK(format_gpu_metadata({200, 1}) == R"(<gpu weight="200" device="1"/>)");
    CHECK(format_gpu_metadata({200}) == R"(<gpu weight="200"/>)");
    const GpuMetadata back = parse_gpu_metadata(format_gpu_metadata({345, 7}));
    CHECK(back.weight == 345);
    CHECK(back.device == 7u);
}

TEST_CASE("gpu metadata: a bad device is an error naming the attribute", "[libvirt]") {
    for (const char* bad : {R"(<gpu device="16"/>)", R"(<gpu device="-1"/>)", R"(<gpu device=""/>)",
                            R"(<gpu device="one"/>)", R"(<gpu device=" 1"/>)", R"(<gpu device="1.0"/>)",
                            R"(<gpu weight="200" device="99999999999999999999"/>)", R"(<gpu devcie="1"/>)"}) {
        INFO(bad);
        CHECK_THROWS_AS(parse_gpu_metadata(bad), XmlError);
    }
    try {
        parse_gpu_metadata(R"(<gpu weight="200" device="16"/>)");
        FAIL("accepted");
    } catch (const XmlError& e) {
        CHECK(std::string(e.what()) == "pvgpu metadata: device '16' is not a GPU index in 0..15");
    }
    try {
        parse_gpu_metadata(R"(<gpu weight="0" device="1"/>)");
        FAIL("accepted");
    } catch (const XmlError& e) {
        CHECK(std::string(e.what()).find("weight '0'") != std::string::npos);
    }
}

TEST_CASE("attach writes the device's gpu property", "[libvirt]") {
    std::string xml = attach_device(kDomain, {"/s.sock", 0, "", 1});
    CHECK(count(xml, "pvgpu,chardev=pvgpu0,gpu=1") == 1);
    xml = attach_device(xml, {"/s.sock", 32, "", 15});
    CHECK(count(xml, "-device") == 1);
    CHECK(count(xml, "pvgpu,chardev=pvgpu0,slots=32,gpu=15") == 1);
    // Attached again without a GPU: pvgpud places it, no gpu= left.
    xml = attach_device(xml, {"/s.sock", 0, ""});
    CHECK(count(xml, "gpu=") == 0);
    CHECK(count(xml, "pvgpu,chardev=pvgpu0") == 1);
    CHECK_THROWS_AS(attach_device(kDomain, {"/s.sock", 0, "", 16}), XmlError);
}

TEST_CASE("attach adds the device once and keeps the admin's arguments", "[libvirt]") {
    std::string xml = attach_device(kDomain, {"/run/pvgpu/pvgpud.sock", 0, ""});
    CHECK(has_device(xml));
    CHECK(count(xml, "socket,id=pvgpu0,path=/run/pvgpu/pvgpud.sock,reconnect=1") == 1);
    CHECK(count(xml, "pvgpu,chardev=pvgpu0") == 1);
    CHECK(count(xml, "/usr/share/seabios") == 1);
    CHECK(count(xml, "/usr/bin/qemu-system-x86_64") == 1);
    // Again, with another socket, the patched QEMU and slots: replaced, not doubled.
    xml = attach_device(xml, {"/tmp/other.sock", 32, "/opt/pvgpu/qemu-system-x86_64"});
    CHECK(count(xml, "-device") == 1);
    CHECK(count(xml, "path=/tmp/other.sock") == 1);
    CHECK(count(xml, "path=/run/pvgpu") == 0);
    CHECK(count(xml, "pvgpu,chardev=pvgpu0,slots=32") == 1);
    CHECK(count(xml, "<emulator>/opt/pvgpu/qemu-system-x86_64</emulator>") == 1);
    CHECK(domain_ids(xml).name == "web1");
    CHECK(domain_ids(xml).uuid == "5f0c1a2e-8d1b-4c55-9a10-6e0d2fbeb602");
}

TEST_CASE("attach works on a domain without a qemu namespace or commandline", "[libvirt]") {
    const std::string xml = attach_device("<domain type='kvm'><name>a</name></domain>", {"/s.sock", 0, ""});
    CHECK(has_device(xml));
    CHECK(count(xml, "xmlns:qemu=\"http://libvirt.org/schemas/domain/qemu/1.0\"") == 1);
}

TEST_CASE("detach removes the device and its chardev only", "[libvirt]") {
    // A hand-wired device on another chardev id, and an unrelated chardev.
    const std::string wired = R"(<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>b</name>
  <qemu:commandline>
    <qemu:arg value='-chardev'/><qemu:arg value='socket,id=mine,path=/x'/>
    <qemu:arg value='-chardev'/><qemu:arg value='socket,id=pv7,path=/run/pvgpu/pvgpud.sock'/>
    <qemu:arg value='-device'/><qemu:arg value='pvgpu,chardev=pv7'/>
  </qemu:commandline>
</domain>)";
    CHECK(has_device(wired));
    const std::string xml = detach_device(wired);
    CHECK_FALSE(has_device(xml));
    CHECK(count(xml, "id=mine") == 1);
    CHECK(count(xml, "pv7") == 0);
    // Nothing of ours left: the empty commandline goes too.
    const std::string clean = detach_device(attach_device("<domain><name>c</name></domain>", {"/s", 0, ""}));
    CHECK(count(clean, "commandline") == 0);
    CHECK_FALSE(has_device(clean));
}

TEST_CASE("domain XML errors name the problem", "[libvirt]") {
    CHECK_THROWS_AS(attach_device("<notadomain/>", {"/s", 0, ""}), XmlError);
    CHECK_THROWS_AS(attach_device("<domain>", {"/s", 0, ""}), XmlError);
    CHECK_THROWS_AS(attach_device(kDomain, {"/a,b", 0, ""}), XmlError);  // ',' would split QEMU's options
    CHECK_THROWS_AS(attach_device(kDomain, {"", 0, ""}), XmlError);
}

TEST_CASE("attach with metadata writes <pvgpu:gpu> into the domain's <metadata>", "[libvirt]") {
    const char* kubevirt = R"(<domain type="kvm" xmlns:qemu="http://libvirt.org/schemas/domain/qemu/1.0">
  <name>default_vmi</name>
  <metadata>
    <kubevirt xmlns="http://kubevirt.io"><uid>3f0b6a52</uid></kubevirt>
    <pvgpu:gpu xmlns:pvgpu="http://pvgpu.org/xmlns/domain/1.0" weight="50"/>
  </metadata>
  <qemu:commandline>
    <qemu:arg value="-fw_cfg"/><qemu:arg value="name=opt/x,string=y"/>
    <qemu:env name="A" value="b"/>
  </qemu:commandline>
</domain>)";
    std::string xml = attach_device(kubevirt, {"/s.sock", 0, "", 2}, GpuMetadata{300, 2});
    // The old element replaced, kubevirt's kept, in libvirt's form for our namespace.
    CHECK(count(xml, "<pvgpu:gpu xmlns:pvgpu=\"http://pvgpu.org/xmlns/domain/1.0\" weight=\"300\" "
                     "device=\"2\"/>") == 1);
    CHECK(count(xml, "weight=\"50\"") == 0);
    CHECK(count(xml, "<uid>3f0b6a52</uid>") == 1);
    CHECK(count(xml, "pvgpu,chardev=pvgpu0,gpu=2") == 1);
    // The new arguments after the domain's own, before <qemu:env> (libvirt's order).
    CHECK(xml.find("name=opt/x,string=y") < xml.find("-chardev"));
    CHECK(xml.find("pvgpu,chardev=pvgpu0") < xml.find("<qemu:env"));
    // No <metadata> yet: made; no device: no attribute.
    xml = attach_device("<domain><name>n</name></domain>", {"/s.sock", 0, ""}, GpuMetadata{100});
    CHECK(count(xml, "<metadata>") == 1);
    CHECK(count(xml, "weight=\"100\"/>") == 1);
    CHECK(count(xml, "device=") == 0);
}

TEST_CASE("the share's text rules pvgpuctl and the KubeVirt hook share", "[libvirt]") {
    CHECK(pvgpu::parse_weight("1") == 1u);
    CHECK(pvgpu::parse_weight("10000") == 10000u);
    CHECK(pvgpu::parse_weight("0300") == 300u);
    for (const char* bad : {"0", "10001", "-5", "+5", " 5", "5 ", "2e2", "", "abc", "99999999999999999999"}) {
        INFO(bad);
        CHECK_FALSE(pvgpu::parse_weight(bad));
    }
    CHECK(pvgpu::parse_gpu_index("0") == 0u);
    CHECK(pvgpu::parse_gpu_index("15") == 15u);
    CHECK_FALSE(pvgpu::parse_gpu_index("16"));
    CHECK_FALSE(pvgpu::parse_gpu_index("any"));
    CHECK(pvgpu::parse_gpu_choice("any"));
    CHECK_FALSE(pvgpu::parse_gpu_choice("any")->index);
    CHECK(pvgpu::parse_gpu_choice("3")->index == 3u);
    for (const char* bad : {"16", "-1", "", "ANY", "gpu0", "1.0"}) {
        INFO(bad);
        CHECK_FALSE(pvgpu::parse_gpu_choice(bad));
    }
}
