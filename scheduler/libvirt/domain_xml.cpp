#include "domain_xml.hpp"

#include <libxml/parser.h>
#include <libxml/tree.h>
#include <pvgpu/abi.h>
#include <pvgpu/protocol.h>

#include "proto/share_text.hpp"

#include <cstring>
#include <memory>
#include <vector>

namespace pvgpu::virt {

namespace {

struct DocFree {
    void operator()(xmlDoc* d) const { xmlFreeDoc(d); }
};
using Doc = std::unique_ptr<xmlDoc, DocFree>;

const xmlChar* x(const char* s) { return reinterpret_cast<const xmlChar*>(s); }
std::string str(const xmlChar* s) { return s ? reinterpret_cast<const char*>(s) : ""; }

// Parses without network access and without printing errors: the caller
// gets the parser's message in the exception.
Doc parse(std::string_view text, const char* what) {
    std::unique_ptr<xmlParserCtxt, decltype(&xmlFreeParserCtxt)> ctxt(xmlNewParserCtxt(), xmlFreeParserCtxt);
    if (!ctxt) throw XmlError(std::string(what) + ": out of memory");
    Doc doc(xmlCtxtReadMemory(ctxt.get(), text.data(), static_cast<int>(text.size()), what, nullptr,
                              XML_PARSE_NONET | XML_PARSE_NOBLANKS | XML_PARSE_NOERROR | XML_PARSE_NOWARNING));
    if (!doc || !xmlDocGetRootElement(doc.get())) {
        std::string msg = ctxt->lastError.message ? ctxt->lastError.message : "not XML";
        while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
        throw XmlError(std::string(what) + ": " + msg);
    }
    return doc;
}

std::string dump(xmlDoc* doc) {
    xmlChar* mem = nullptr;
    int size = 0;
    xmlDocDumpFormatMemory(doc, &mem, &size, 1);
    std::string out(reinterpret_cast<const char*>(mem), static_cast<std::size_t>(size));
    xmlFree(mem);
    return out;
}

bool is_element(const xmlNode* n, const char* name, const char* ns_href) {
    if (!n || n->type != XML_ELEMENT_NODE || std::strcmp(reinterpret_cast<const char*>(n->name), name) != 0)
        return false;
    if (!ns_href) return n->ns == nullptr;
    return n->ns && str(n->ns->href) == ns_href;
}

xmlNode* child(xmlNode* parent, const char* name, const char* ns_href) {
    for (xmlNode* c = parent->children; c; c = c->next)
        if (is_element(c, name, ns_href)) return c;
    return nullptr;
}

xmlNode* domain_root(xmlDoc* doc) {
    xmlNode* root = xmlDocGetRootElement(doc);
    if (!is_element(root, "domain", nullptr)) throw XmlError("domain XML: the root element is not <domain>");
    return root;
}

// "key=value,key=value" option string of a QEMU argument: the value of key.
std::string option(std::string_view opts, std::string_view key) {
    std::size_t pos = 0;
    while (pos <= opts.size()) {
        std::size_t end = opts.find(',', pos);
        if (end == std::string_view::npos) end = opts.size();
        std::string_view item = opts.substr(pos, end - pos);
        if (item.size() > key.size() && item.substr(0, key.size()) == key && item[key.size()] == '=')
            return std::string(item.substr(key.size() + 1));
        pos = end + 1;
    }
    return {};
}

bool is_pvgpu_device(std::string_view v) { return v == "pvgpu" || v.rfind("pvgpu,", 0) == 0; }

// The qemu:arg elements of <qemu:commandline>, in order, with their values.
std::vector<std::pair<xmlNode*, std::string>> args_of(xmlNode* cmdline) {
    std::vector<std::pair<xmlNode*, std::string>> args;
    if (!cmdline) return args;
    for (xmlNode* c = cmdline->children; c; c = c->next)
        if (is_element(c, "arg", kQemuNamespace)) {
            xmlChar* v = xmlGetProp(c, x("value"));
            args.emplace_back(c, str(v));
            xmlFree(v);
        }
    return args;
}

// Unlinks the pvgpu `-device` pairs and the `-chardev` pairs they name.
// Returns how many devices were removed.
int remove_pvgpu_args(xmlNode* cmdline) {
    auto args = args_of(cmdline);
    std::vector<std::string> chardevs;
    std::vector<std::size_t> drop;
    for (std::size_t i = 0; i + 1 < args.size(); ++i)
        if (args[i].second == "-device" && is_pvgpu_device(args[i + 1].second)) {
            chardevs.push_back(option(args[i + 1].second, "chardev"));
            drop.insert(drop.end(), {i, i + 1});
        }
    for (std::size_t i = 0; i + 1 < args.size(); ++i)
        if (args[i].second == "-chardev") {
            const std::string id = option(args[i + 1].second, "id");
            for (const auto& c : chardevs)
                if (!id.empty() && id == c) drop.insert(drop.end(), {i, i + 1});
        }
    std::vector<bool> gone(args.size(), false);
    for (std::size_t i : drop) gone[i] = true;
    for (std::size_t i = 0; i < args.size(); ++i)
        if (gone[i]) {
            xmlUnlinkNode(args[i].first);
            xmlFreeNode(args[i].first);
        }
    return static_cast<int>(chardevs.size());
}

}  // namespace

GpuMetadata parse_gpu_metadata(std::string_view xml) {
    Doc doc = parse(xml, "pvgpu metadata");
    xmlNode* root = xmlDocGetRootElement(doc.get());
    if (std::strcmp(reinterpret_cast<const char*>(root->name), "gpu") != 0)
        throw XmlError("pvgpu metadata: expected <gpu weight=\"N\"/>, found <" + str(root->name) + ">");
    if (root->ns && str(root->ns->href) != kMetadataNamespace)
        throw XmlError("pvgpu metadata: <gpu> in namespace " + str(root->ns->href) + ", expected " +
                       kMetadataNamespace);
    for (xmlNode* c = root->children; c; c = c->next)
        if (c->type == XML_ELEMENT_NODE)
            throw XmlError("pvgpu metadata: unexpected element <" + str(c->name) + "> inside <gpu>");
    GpuMetadata m{PVGPU_WEIGHT_DEFAULT, std::nullopt};
    for (xmlAttr* a = root->properties; a; a = a->next) {
        const std::string name = str(a->name);
        if ((name != "weight" && name != "device") || a->ns)
            throw XmlError("pvgpu metadata: unknown attribute '" + name + "' of <gpu>");
        xmlChar* v = xmlNodeListGetString(doc.get(), a->children, 1);
        const std::string value = str(v);
        xmlFree(v);
        const bool weight = name == "weight";
        const std::uint64_t lo = weight ? PVGPU_WEIGHT_MIN : 0;
        const std::uint64_t hi = weight ? PVGPU_WEIGHT_MAX : PVGPU_MAX_GPUS - 1;
        const std::optional<std::uint32_t> n = weight ? parse_weight(value) : parse_gpu_index(value);
        if (!n)
            throw XmlError("pvgpu metadata: " + name + " '" + value + "' is not " +
                           (weight ? "an integer" : "a GPU index") + " in " + std::to_string(lo) + ".." +
                           std::to_string(hi));
        if (weight)
            m.weight = *n;
        else
            m.device = *n;
    }
    return m;
}

std::string format_gpu_metadata(const GpuMetadata& m) {
    std::string xml = "<gpu weight=\"" + std::to_string(m.weight) + "\"";
    if (m.device) xml += " device=\"" + std::to_string(*m.device) + "\"";
    return xml + "/>";
}

namespace {

// attach_device's edit of a parsed domain: the chardev and device arguments
// (replacing pvgpu's old ones) and, with w.emulator, <emulator>.
void wire_device(xmlDoc* doc, const DeviceWiring& w) {
    if (w.socket.empty() || w.socket.find(',') != std::string::npos)
        throw XmlError("pvgpu socket path '" + w.socket + "' is empty or contains ','");
    xmlNode* root = domain_root(doc);
    xmlNs* ns = xmlSearchNsByHref(doc, root, x(kQemuNamespace));
    if (!ns) ns = xmlNewNs(root, x(kQemuNamespace), x("qemu"));
    xmlNode* cmdline = child(root, "commandline", kQemuNamespace);
    if (cmdline)
        remove_pvgpu_args(cmdline);
    else
        cmdline = xmlNewChild(root, ns, x("commandline"), nullptr);
    std::string device = std::string("pvgpu,chardev=") + kChardevId;
    if (w.slots) device += ",slots=" + std::to_string(w.slots);
    if (w.gpu) {
        if (*w.gpu >= PVGPU_MAX_GPUS)
            throw XmlError("pvgpu GPU " + std::to_string(*w.gpu) + " is not a GPU index in 0.." +
                           std::to_string(PVGPU_MAX_GPUS - 1));
        device += ",gpu=" + std::to_string(*w.gpu);
    }
    const std::string chardev = std::string("socket,id=") + kChardevId + ",path=" + w.socket + ",reconnect=1";
    // After the other arguments, before any <qemu:env>: libvirt's own order.
    xmlNode* first_env = child(cmdline, "env", kQemuNamespace);
    for (const std::string& v : {std::string("-chardev"), chardev, std::string("-device"), device}) {
        xmlNode* arg = xmlNewNode(ns, x("arg"));
        xmlNewProp(arg, x("value"), x(v.c_str()));
        if (first_env)
            xmlAddPrevSibling(first_env, arg);
        else
            xmlAddChild(cmdline, arg);
    }
    if (!w.emulator.empty()) {
        xmlNode* devices = child(root, "devices", nullptr);
        if (!devices) devices = xmlNewChild(root, nullptr, x("devices"), nullptr);
        xmlNode* emu = child(devices, "emulator", nullptr);
        if (!emu) emu = xmlNewChild(devices, nullptr, x("emulator"), nullptr);
        xmlNodeSetContent(emu, nullptr);
        xmlNodeAddContent(emu, x(w.emulator.c_str()));
    }
}

// <pvgpu:gpu xmlns:pvgpu="..." weight="W" [device="N"]/> in <metadata>, as
// libvirt keeps what virDomainSetMetadata (pvgpuctl attach) writes: the
// namespace declared on the element itself.
void put_gpu_metadata(xmlDoc* doc, const GpuMetadata& m) {
    xmlNode* root = domain_root(doc);
    xmlNode* metadata = child(root, "metadata", nullptr);
    if (!metadata) metadata = xmlNewChild(root, nullptr, x("metadata"), nullptr);
    while (xmlNode* old = child(metadata, "gpu", kMetadataNamespace)) {
        xmlUnlinkNode(old);
        xmlFreeNode(old);
    }
    xmlNode* gpu = xmlNewChild(metadata, nullptr, x("gpu"), nullptr);
    xmlSetNs(gpu, xmlNewNs(gpu, x(kMetadataNamespace), x(kMetadataPrefix)));
    xmlNewProp(gpu, x("weight"), x(std::to_string(m.weight).c_str()));
    if (m.device) xmlNewProp(gpu, x("device"), x(std::to_string(*m.device).c_str()));
}

}  // namespace

std::string attach_device(std::string_view domain_xml, const DeviceWiring& w) {
    Doc doc = parse(domain_xml, "domain XML");
    wire_device(doc.get(), w);
    return dump(doc.get());
}

std::string attach_device(std::string_view domain_xml, const DeviceWiring& w, const GpuMetadata& m) {
    Doc doc = parse(domain_xml, "domain XML");
    wire_device(doc.get(), w);
    put_gpu_metadata(doc.get(), m);
    return dump(doc.get());
}

std::string detach_device(std::string_view domain_xml) {
    Doc doc = parse(domain_xml, "domain XML");
    xmlNode* root = domain_root(doc.get());
    if (xmlNode* cmdline = child(root, "commandline", kQemuNamespace)) {
        remove_pvgpu_args(cmdline);
        bool empty = true;
        for (xmlNode* c = cmdline->children; c; c = c->next) empty = empty && c->type != XML_ELEMENT_NODE;
        if (empty) {
            xmlUnlinkNode(cmdline);
            xmlFreeNode(cmdline);
        }
    }
    return dump(doc.get());
}

bool has_device(std::string_view domain_xml) {
    Doc doc = parse(domain_xml, "domain XML");
    auto args = args_of(child(domain_root(doc.get()), "commandline", kQemuNamespace));
    for (std::size_t i = 0; i + 1 < args.size(); ++i)
        if (args[i].second == "-device" && is_pvgpu_device(args[i + 1].second)) return true;
    return false;
}

DomainIds domain_ids(std::string_view domain_xml) {
    Doc doc = parse(domain_xml, "domain XML");
    xmlNode* root = domain_root(doc.get());
    DomainIds ids;
    for (const char* n : {"uuid", "name"}) {
        xmlNode* c = child(root, n, nullptr);
        xmlChar* v = c ? xmlNodeGetContent(c) : nullptr;
        (std::strcmp(n, "uuid") == 0 ? ids.uuid : ids.name) = str(v);
        xmlFree(v);
    }
    return ids;
}

}  // namespace pvgpu::virt
