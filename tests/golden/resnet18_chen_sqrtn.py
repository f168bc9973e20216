


def forward(self, x : torch.Tensor) -> torch.Tensor:
    import remat.runtime
    remat.runtime.check_inputs(self, x)
    def ckpt_0(x):  # stages 0..3: conv1 .. layer1_0_relu_1
        conv1 = self.conv1(x);  x = None
        bn1 = self.bn1(conv1);  conv1 = None
        relu = self.relu(bn1);  bn1 = None
        maxpool = self.maxpool(relu);  relu = None
        layer1_0_conv1 = getattr(self.layer1, "0").conv1(maxpool)
        layer1_0_bn1 = getattr(self.layer1, "0").bn1(layer1_0_conv1);  layer1_0_conv1 = None
        layer1_0_relu = getattr(self.layer1, "0").relu(layer1_0_bn1);  layer1_0_bn1 = None
        layer1_0_conv2 = getattr(self.layer1, "0").conv2(layer1_0_relu);  layer1_0_relu = None
        layer1_0_bn2 = getattr(self.layer1, "0").bn2(layer1_0_conv2);  layer1_0_conv2 = None
        layer1_0_bn2 += maxpool;  iadd = layer1_0_bn2;  layer1_0_bn2 = maxpool = None
        layer1_0_relu_1 = getattr(self.layer1, "0").relu(iadd);  iadd = None
        return layer1_0_relu_1
    layer1_0_relu_1 = torch.utils.checkpoint.checkpoint(ckpt_0, x, use_reentrant=False, preserve_rng_state=False, **remat.runtime.context(self, freeze="modules"));  x = None
    def ckpt_1(layer1_0_relu_1):  # stages 4..7: layer1_1_conv1 .. layer3_0_relu_1
        layer1_1_conv1 = getattr(self.layer1, "1").conv1(layer1_0_relu_1)
        layer1_1_bn1 = getattr(self.layer1, "1").bn1(layer1_1_conv1);  layer1_1_conv1 = None
        layer1_1_relu = getattr(self.layer1, "1").relu(layer1_1_bn1);  layer1_1_bn1 = None
        layer1_1_conv2 = getattr(self.layer1, "1").conv2(layer1_1_relu);  layer1_1_relu = None
        layer1_1_bn2 = getattr(self.layer1, "1").bn2(layer1_1_conv2);  layer1_1_conv2 = None
        layer1_1_bn2 += layer1_0_relu_1;  iadd_1 = layer1_1_bn2;  layer1_1_bn2 = layer1_0_relu_1 = None
        layer1_1_relu_1 = getattr(self.layer1, "1").relu(iadd_1);  iadd_1 = None
        layer2_0_conv1 = getattr(self.layer2, "0").conv1(layer1_1_relu_1)
        layer2_0_bn1 = getattr(self.layer2, "0").bn1(layer2_0_conv1);  layer2_0_conv1 = None
        layer2_0_relu = getattr(self.layer2, "0").relu(layer2_0_bn1);  layer2_0_bn1 = None
        layer2_0_conv2 = getattr(self.layer2, "0").conv2(layer2_0_relu);  layer2_0_relu = None
        layer2_0_bn2 = getattr(self.layer2, "0").bn2(layer2_0_conv2);  layer2_0_conv2 = None
        layer2_0_downsample_0 = getattr(getattr(self.layer2, "0").downsample, "0")(layer1_1_relu_1);  layer1_1_relu_1 = None
        layer2_0_downsample_1 = getattr(getattr(self.layer2, "0").downsample, "1")(layer2_0_downsample_0);  layer2_0_downsample_0 = None
        layer2_0_bn2 += layer2_0_downsample_1;  iadd_2 = layer2_0_bn2;  layer2_0_bn2 = layer2_0_downsample_1 = None
        layer2_0_relu_1 = getattr(self.layer2, "0").relu(iadd_2);  iadd_2 = None
        layer2_1_conv1 = getattr(self.layer2, "1").conv1(layer2_0_relu_1)
        layer2_1_bn1 = getattr(self.layer2, "1").bn1(layer2_1_conv1);  layer2_1_conv1 = None
        layer2_1_relu = getattr(self.layer2, "1").relu(layer2_1_bn1);  layer2_1_bn1 = None
        layer2_1_conv2 = getattr(self.layer2, "1").conv2(layer2_1_relu);  layer2_1_relu = None
        layer2_1_bn2 = getattr(self.layer2, "1").bn2(layer2_1_conv2);  layer2_1_conv2 = None
        layer2_1_bn2 += layer2_0_relu_1;  iadd_3 = layer2_1_bn2;  layer2_1_bn2 = layer2_0_relu_1 = None
        layer2_1_relu_1 = getattr(self.layer2, "1").relu(iadd_3);  iadd_3 = None
        layer3_0_conv1 = getattr(self.layer3, "0").conv1(layer2_1_relu_1)
        layer3_0_bn1 = getattr(self.layer3, "0").bn1(layer3_0_conv1);  layer3_0_conv1 = None
        layer3_0_relu = getattr(self.layer3, "0").relu(layer3_0_bn1);  layer3_0_bn1 = None
        layer3_0_conv2 = getattr(self.layer3, "0").conv2(layer3_0_relu);  layer3_0_relu = None
        layer3_0_bn2 = getattr(self.layer3, "0").bn2(layer3_0_conv2);  layer3_0_conv2 = None
        layer3_0_downsample_0 = getattr(getattr(self.layer3, "0").downsample, "0")(layer2_1_relu_1);  layer2_1_relu_1 = None
        layer3_0_downsample_1 = getattr(getattr(self.layer3, "0").downsample, "1")(layer3_0_downsample_0);  layer3_0_downsample_0 = None
        layer3_0_bn2 += layer3_0_downsample_1;  iadd_4 = layer3_0_bn2;  layer3_0_bn2 = layer3_0_downsample_1 = None
        layer3_0_relu_1 = getattr(self.layer3, "0").relu(iadd_4);  iadd_4 = None
        return layer3_0_relu_1
    layer3_0_relu_1 = torch.utils.checkpoint.checkpoint(ckpt_1, layer1_0_relu_1, use_reentrant=False, preserve_rng_state=False, **remat.runtime.context(self, freeze="modules"));  layer1_0_relu_1 = None
    def ckpt_2(layer3_0_relu_1):  # stages 8..11: layer3_1_conv1 .. avgpool
        layer3_1_conv1 = getattr(self.layer3, "1").conv1(layer3_0_relu_1)
        layer3_1_bn1 = getattr(self.layer3, "1").bn1(layer3_1_conv1);  layer3_1_conv1 = None
        layer3_1_relu = getattr(self.layer3, "1").relu(layer3_1_bn1);  layer3_1_bn1 = None
        layer3_1_conv2 = getattr(self.layer3, "1").conv2(layer3_1_relu);  layer3_1_relu = None
        layer3_1_bn2 = getattr(self.layer3, "1").bn2(layer3_1_conv2);  layer3_1_conv2 = None
        layer3_1_bn2 += layer3_0_relu_1;  iadd_5 = layer3_1_bn2;  layer3_1_bn2 = layer3_0_relu_1 = None
        layer3_1_relu_1 = getattr(self.layer3, "1").relu(iadd_5);  iadd_5 = None
        layer4_0_conv1 = getattr(self.layer4, "0").conv1(layer3_1_relu_1)
        layer4_0_bn1 = getattr(self.layer4, "0").bn1(layer4_0_conv1);  layer4_0_conv1 = None
        layer4_0_relu = getattr(self.layer4, "0").relu(layer4_0_bn1);  layer4_0_bn1 = None
        layer4_0_conv2 = getattr(self.layer4, "0").conv2(layer4_0_relu);  layer4_0_relu = None
        layer4_0_bn2 = getattr(self.layer4, "0").bn2(layer4_0_conv2);  layer4_0_conv2 = None
        layer4_0_downsample_0 = getattr(getattr(self.layer4, "0").downsample, "0")(layer3_1_relu_1);  layer3_1_relu_1 = None
        layer4_0_downsample_1 = getattr(getattr(self.layer4, "0").downsample, "1")(layer4_0_downsample_0);  layer4_0_downsample_0 = None
        layer4_0_bn2 += layer4_0_downsample_1;  iadd_6 = layer4_0_bn2;  layer4_0_bn2 = layer4_0_downsample_1 = None
        layer4_0_relu_1 = getattr(self.layer4, "0").relu(iadd_6);  iadd_6 = None
        layer4_1_conv1 = getattr(self.layer4, "1").conv1(layer4_0_relu_1)
        layer4_1_bn1 = getattr(self.layer4, "1").bn1(layer4_1_conv1);  layer4_1_conv1 = None
        layer4_1_relu = getattr(self.layer4, "1").relu(layer4_1_bn1);  layer4_1_bn1 = None
        layer4_1_conv2 = getattr(self.layer4, "1").conv2(layer4_1_relu);  layer4_1_relu = None
        layer4_1_bn2 = getattr(self.layer4, "1").bn2(layer4_1_conv2);  layer4_1_conv2 = None
        layer4_1_bn2 += layer4_0_relu_1;  iadd_7 = layer4_1_bn2;  layer4_1_bn2 = layer4_0_relu_1 = None
        layer4_1_relu_1 = getattr(self.layer4, "1").relu(iadd_7);  iadd_7 = None
        avgpool = self.avgpool(layer4_1_relu_1);  layer4_1_relu_1 = None
        return avgpool
    avgpool = torch.utils.checkpoint.checkpoint(ckpt_2, layer3_0_relu_1, use_reentrant=False, preserve_rng_state=False, **remat.runtime.context(self, freeze="modules"));  layer3_0_relu_1 = None
    flatten = torch.flatten(avgpool, 1);  avgpool = None
    fc = self.fc(flatten);  flatten = None
    return fc
    